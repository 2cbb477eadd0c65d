"""``cairn doctor``'s look at a store: whether it is encrypted, and a warning for a bucket that
is not (ADR 0025). Opens the store the way every cairn process does (the configured secret).
Its findings are warnings: the doctor's verdict is about the host, not the store."""

from __future__ import annotations

from cairn.exceptions import CairnError, ConfigError, NotFound
from cairn.process.doctor import Check, Status
from cairn.runtime import env
from cairn.runtime.stores import configured_secret, open_store
from cairn.store import SecretError, store_kind

NAME = "store encryption"


def store_check(url: str) -> Check:
    """One check of the store at ``url``; never creates it."""
    bucket = store_kind(url).remote
    fix_unencrypted = (f"create a new store with {env.SECRET_FILE} set (`cairn secret new PATH` "
                       "makes one; docs/encryption.md); an existing store keeps its format")
    try:
        store = open_store(url, create=False)
    except NotFound:
        try:
            secret = configured_secret()
        except ConfigError as e:
            return Check(NAME, Status.WARN, str(e), f"fix {env.SECRET_FILE}")
        if secret is not None:
            return Check(NAME, Status.OK, f"no store at {url} yet; it will be created "
                         f"encrypted with secret {secret.id}")
        return Check(NAME, Status.WARN if bucket else Status.OK,
                     f"no store at {url} yet; it would be created unencrypted",
                     fix_unencrypted if bucket else "")
    except SecretError as e:  # a wrong or missing secret, a downgrade
        return Check(NAME, Status.WARN, str(e), f"give the store's secret in {env.SECRET_FILE}")
    except CairnError as e:
        return Check(NAME, Status.WARN, f"cannot open {url}: {e}", "check the URL and access")
    with store:
        if store.encrypted:
            keyring = store.keyring
            assert keyring is not None
            return Check(NAME, Status.OK, f"{url} is encrypted (AES-256-GCM); active data key "
                         f"{keyring.active}, {len(keyring.keys)} key(s), keyring record "
                         f"{keyring.seq} sealed by secret {keyring.secret_id}")
        if bucket:
            return Check(NAME, Status.WARN, f"{url} is NOT encrypted: whoever can read the "
                         "bucket reads every snapshot (a process snapshot holds the whole "
                         "memory of the step), and whoever can write it chooses what the next "
                         "try restores", fix_unencrypted)
        return Check(NAME, Status.OK, f"{url} is an unencrypted local store (encryption is "
                     "opt-in)")
