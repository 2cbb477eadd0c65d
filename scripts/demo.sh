#!/usr/bin/env bash
# The demo: a "training step" keeps a checkpoint directory; cairn snapshots it into a local
# store, a second snapshot deduplicates, a corrupted newest snapshot is skipped on restore, and
# finishing the step cleans up. Everything happens under .demo/ in this checkout.
set -euo pipefail
root="$(pwd)/.demo"
rm -rf "$root"
mkdir -p "$root/work/ckpt"
store="file://$root/store"
key="demo-dag/train/manual__2026-11-29/0"

say() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
run() { say "$*"; "$@"; }

python - "$root/work/ckpt" <<'PY'
import os, sys, random
rng = random.Random(1)
d = sys.argv[1]
open(os.path.join(d, "model.bin"), "wb").write(rng.randbytes(24 << 20))
open(os.path.join(d, "optimizer.bin"), "wb").write(rng.randbytes(8 << 20))
open(os.path.join(d, "progress.json"), "w").write('{"step": 100}')
PY

run cairn put "$store" "$key" "$root/work/ckpt" --step 100
# The next "training step" changes 4 MiB of the model and the progress file.
python - "$root/work/ckpt" <<'PY'
import os, sys
d = sys.argv[1]
with open(os.path.join(d, "model.bin"), "r+b") as f:
    f.seek(8 << 20); f.write(os.urandom(4 << 20))
open(os.path.join(d, "progress.json"), "w").write('{"step": 200}')
PY
run cairn put "$store" "$key" "$root/work/ckpt" --step 200
run cairn ls "$store"
run cairn ls "$store" "$key"

say "corrupt one byte of a chunk that only the newest snapshot has"
python - "$root/store" "$key" <<'PY'
import sys
from cairn import Key, open_store
store = open_store(sys.argv[1], create=False)
key = Key.parse(sys.argv[2])
newest, older = [i.manifest for i in store.snapshots(key)][:2]
old = {c.digest for c in older.chunk_refs()}
chunk = next(c for c in newest.chunk_refs() if c.digest not in old)
path = f"{sys.argv[1]}/{chunk.pack}"
with open(path, "r+b") as f:
    f.seek(chunk.offset); b = f.read(1); f.seek(chunk.offset); f.write(bytes([b[0] ^ 0xFF]))
print(f"flipped a byte of chunk {chunk.digest[:16]}... in {chunk.pack}")
PY
set +e
run cairn verify "$store" "$key"
echo "exit code $? (4 = a snapshot is corrupt)"
set -e
run cairn get "$store" "$key" "$root/restored"
python - "$root/restored/progress.json" <<'PY'
import sys; print("restored progress:", open(sys.argv[1]).read(), "(the previous good snapshot)")
PY
run cairn gc "$store" --dry-run
say "done: the store is in $root/store"
