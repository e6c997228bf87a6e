"""Moved to ``connectors.testing.conformance`` (the public conformance kit); this name
stays for the tests that import it: it is the same module object."""

import sys

from connectors.testing import conformance

sys.modules[__name__] = conformance
