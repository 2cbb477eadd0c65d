"""The ``gs`` kind: a prefix of a Google Cloud Storage bucket (``gs://BUCKET/PREFIX``), served
by :class:`cairn.store.gcs.GCSBackend` (the ``gcs`` extra)."""

from __future__ import annotations

from urllib.parse import urlsplit

from cairn.exceptions import ConfigError
from cairn.store.kind import ConnectionField, Setting, StoreKind

FORM = "gs://BUCKET/PREFIX"


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of a ``gs://`` URL. Raises :class:`ConfigError` naming the form."""
    parts = urlsplit(url.strip())
    if parts.scheme != "gs" or not parts.netloc:
        raise ConfigError(f"GCS URL {url!r} has no bucket; give {FORM}")
    if parts.query or parts.fragment:
        raise ConfigError(f"GCS URL {url!r} has a query or fragment; give {FORM}")
    return parts.netloc, parts.path.strip("/")


def canonical(url: str) -> str:
    """The URL with the prefix's outer slashes removed, as the backend names its store."""
    bucket, prefix = bucket_and_prefix(url)
    return f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"


KIND = StoreKind(
    scheme="gs",
    title="Google Cloud Storage",
    url_form=FORM,
    remote=True,
    opener="cairn.store.gcs:open_url",
    install_hint="pip install 'cairn-resume[gcs]'",
    validate=bucket_and_prefix,
    canonical=canonical,
    # What google-auth and cairn.store.gcs read. Workload Identity needs none of them.
    environment=(
        Setting(name="GOOGLE_APPLICATION_CREDENTIALS", is_file=True,
                fix="mount the key from a Secret volume, or use Workload Identity (no key "
                    "file)"),
        Setting(name="GOOGLE_CLOUD_PROJECT"),
        Setting(name="STORAGE_EMULATOR_HOST"),
    ),
    # GKE schedules Workload Identity pods only on nodes that run its metadata server.
    node_selector=(("iam.gke.io/gke-metadata-server-enabled", "true"),),
    connection_fields=(
        ConnectionField(extra="gcs_keyfile_path", env="GOOGLE_APPLICATION_CREDENTIALS",
                        label="GCS key file path",
                        description="A service-account JSON key file on the worker; empty: "
                                    "Workload Identity or the worker's default credentials"),
    ),
)
