"""The benchmarks of pods: `python -m bench <name> [options]` (the list is in bench/__main__.py).

Deliberately empty of imports: a sibling imported as `from bench import common` passes through this file, and an
import here would tie every benchmark module to every other.
"""
