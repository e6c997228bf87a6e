"""Moved to ``connectors.testing.data`` (the public conformance kit); this name stays for
the tests that import it: it is the same module object."""

import sys

from connectors.testing import data

sys.modules[__name__] = data
