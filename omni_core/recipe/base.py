"""What every recipe section shares: the strict base model and the credential-free URL field.

`Strict` rejects unknown keys, NaN and infinities, and re-validates on assignment, so that a typo fails at
`omni recipe check` instead of silently falling back to a default. `NoCredentials` keeps user:password@ out
of recipes, which are logged in full.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def redact_userinfo(text: str) -> str:
    """`text` with any URL's user:password@ replaced by ***@, for messages and logs."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def _no_credentials(value: str | None) -> str | None:
    """Refuse a URL carrying user:password@: a recipe is logged as params, artifacts and flow-run parameters."""
    if value and _USERINFO.search(value):
        raise ValueError(
            f"{redact_userinfo(value)} carries credentials: recipes are logged (MLflow params, "
            "recipe.yaml, flow-run parameters); give them through the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME / _PASSWORD)"
        )
    return value


NoCredentials = Annotated[str, AfterValidator(_no_credentials)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
