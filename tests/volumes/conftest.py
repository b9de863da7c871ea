"""The service of tests/api (a NodeOrchestrator over the fake runtime, served over HTTP)
with the e2b SDK pointed at it, volume content API included: `svc`."""

from tests.api.template_service import node_service  # noqa: F401 - fixture
from tests.api.test_volume_sdk import svc  # noqa: F401 - fixture
