"""A real S3 server process for the tests and benches: moto's server (``moto.server``).

moto is a fake of Amazon S3 (it keeps objects in its memory, checks no signature or
permission), but it is a separate HTTP server that boto3 talks to over sockets, and it
enforces the conditions cairn's S3 backend relies on: ``If-None-Match: *`` on PutObject and
CompleteMultipartUpload (412 when the name is taken) and ``If-Match`` on DeleteObject
(``tests/integration/store/test_s3_server.py`` checks each, so an upgrade that drops one
fails there first).

    with S3Server() as server:
        server.make_bucket("cairn-a")
        os.environ.update(server.environment())    # AWS_ENDPOINT_URL and fake credentials
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

#: Credentials moto accepts (it checks none); set so that boto3 never looks further.
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "cairn-test", "AWS_SECRET_ACCESS_KEY": "cairn-test",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server on a free loopback port, as a child process; stop() ends it."""

    def __init__(self, *, python: str = sys.executable, start_timeout: float = 30.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process = subprocess.Popen(
            [python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto's server exited with {self._process.returncode}; is "
                                   "moto[server] installed?")
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not answer on {self.url} within "
                                       f"{start_timeout:.0f}s") from None
                time.sleep(0.05)

    def environment(self, *, endpoint: str | None = None) -> dict[str, str]:
        """What a client process needs to reach this server (``endpoint``: another URL in
        front of it, such as a link proxy's)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.url, **FAKE_CREDENTIALS}

    def client(self, *, endpoint: str | None = None):  # noqa: ANN201 - a boto3 S3 client
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint or self.url,
                            aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            region_name=FAKE_CREDENTIALS["AWS_DEFAULT_REGION"],
                            config=Config(s3={"addressing_style": "path"}))

    def make_bucket(self, name: str, *, versioned: bool = False) -> str:
        client = self.client()
        client.create_bucket(Bucket=name)
        if versioned:
            client.put_bucket_versioning(Bucket=name,
                                         VersioningConfiguration={"Status": "Enabled"})
        return name

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

