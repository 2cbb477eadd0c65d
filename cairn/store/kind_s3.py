"""The ``s3`` kind: a prefix of an S3 bucket (``s3://BUCKET/PREFIX``) on Amazon S3 or any
S3-compatible endpoint (``AWS_ENDPOINT_URL``: MinIO, Ceph, R2), served by
:class:`cairn.store.s3.S3Backend` (the ``s3`` extra)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from cairn.exceptions import ConfigError
from cairn.store.kind import ConnectionField, Setting, StoreKind

FORM = "s3://BUCKET/PREFIX"
#: S3's bucket naming rules (3-63 characters: lower-case letters, digits, dots and hyphens,
#: beginning and ending with a letter or digit); other endpoints accept no more.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``s3://`` URL. Raises :class:`ConfigError` naming the form."""
    parts = urlsplit(url.strip())
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"S3 URL {url!r} has no bucket; give {FORM}")
    if parts.query or parts.fragment:
        raise ConfigError(f"S3 URL {url!r} has a query or fragment; give {FORM}")
    if not _BUCKET.fullmatch(parts.netloc):
        raise ConfigError(f"S3 URL {url!r}: {parts.netloc!r} is not a bucket name (3-63 "
                          "lower-case letters, digits, dots or hyphens); give " + FORM)
    return parts.netloc, parts.path.strip("/")


def canonical(url: str) -> str:
    """The URL with the prefix's outer slashes removed, as the backend names its store."""
    bucket, prefix = bucket_and_prefix(url)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


KIND = StoreKind(
    scheme="s3",
    title="Amazon S3",
    url_form=FORM,
    remote=True,
    opener="cairn.store.s3:open_url",
    install_hint="pip install 'cairn-resume[s3]'",
    validate=bucket_and_prefix,
    canonical=canonical,
    # What boto3's default credential chain and cairn.store.s3 read. IRSA and EKS Pod
    # Identity set their variables and mount their token in every container of the pod
    # (cairn's sidecar included) when the pod is admitted: nothing for cairn to carry.
    environment=(
        Setting(name="AWS_ACCESS_KEY_ID"),
        Setting(name="AWS_SECRET_ACCESS_KEY"),
        Setting(name="AWS_SESSION_TOKEN"),
        Setting(name="AWS_REGION"),
        Setting(name="AWS_DEFAULT_REGION"),
        Setting(name="AWS_PROFILE"),
        Setting(name="AWS_ENDPOINT_URL"),
        Setting(name="AWS_ENDPOINT_URL_S3"),
        Setting(name="AWS_SHARED_CREDENTIALS_FILE", is_file=True),
        Setting(name="AWS_CONFIG_FILE", is_file=True),
        Setting(name="AWS_CA_BUNDLE", is_file=True),
    ),
    connection_fields=(
        ConnectionField(extra="s3_endpoint_url", env="AWS_ENDPOINT_URL",
                        label="S3 endpoint URL",
                        description="An S3-compatible endpoint (MinIO, Ceph, R2); empty: "
                                    "Amazon S3"),
        ConnectionField(extra="s3_region", env="AWS_REGION", label="S3 region",
                        description="The bucket's region; empty: the worker's AWS "
                                    "configuration"),
        ConnectionField(extra="s3_profile", env="AWS_PROFILE", label="AWS profile",
                        description="A profile of the worker's AWS configuration; empty: the "
                                    "default credential chain (IRSA, Pod Identity, instance "
                                    "role)"),
    ),
)
