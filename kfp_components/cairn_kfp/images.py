"""The image cairn components run on.

Components run on an image that already carries cairn, torch and kfp (built from
``containers/Dockerfile.runtime``), never on ``packages_to_install``: a retry that first
reinstalls its packages pays minutes and depends on a package index at the worst moment.
"""

from __future__ import annotations

import cairn

#: The image name used when none is given; build and push it under your own registry and pass
#: ``base_image=`` (see the README): ``docker build -f containers/Dockerfile.runtime -t IMAGE .``
DEFAULT_IMAGE = f"ghcr.io/cairn-project/cairn-runtime:{cairn.__version__}"
