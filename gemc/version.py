"""gemc's version, in the core: the plan records it, and importing the package root (whose
lazy attributes reach the compiler) just to read it would tie the plan builder to the API."""

__version__ = "0.1.0"
