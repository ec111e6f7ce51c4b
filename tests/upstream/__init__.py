"""Upstream's own tests, ported, in upstream's layout (test/registered/...).

The package markers only let pytest tell these files from tests/ files of the same
name; scripts/overlay.py copies the tests into a checkout without them.
"""
