"""The ``torch_dynamo_backends`` entry point ``fxopt`` (see pyproject.toml): what Dynamo loads when
torch.compile meets ``backend="fxopt"``, before it traces anything. Loading it turns Dynamo's
logging switches on (`fxopt.capture.dynamo.install_logging_switches`; why: `fxopt.capture.backend`)."""

from fxopt.capture.backend import fxopt_backend
from fxopt.capture.dynamo import install_logging_switches

install_logging_switches()

__all__ = ["fxopt_backend"]
