"""gemc's tests. A process that imports them with ``TRITON_INTERPRET=1`` (a gloo rank the
runner tests spawn inherits the variable) gets the faster interpreter patching of
:mod:`tests.triton_interpreter`; pytest's own process installs it from conftest.py, once the
variable is chosen."""

from tests.triton_interpreter import install

install()
