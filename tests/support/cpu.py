"""Test marks for what this machine's CPU can run."""

from __future__ import annotations

import pytest

from meshserve.configs.cpu_features import cpu_features

needs_vnni = pytest.mark.skipif(not cpu_features().vnni, reason="w8a8's oneDNN product needs VNNI; without it w8a8 "
                                                                 "is refused (test_w8a8_is_refused_without_vnni)")
