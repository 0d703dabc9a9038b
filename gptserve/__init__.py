"""gptserve: a small, hackable GPT text-generation stack.

One package: `gptserve.model` (the network, checkpoints, tokenizers), `gptserve.kernels`
(attention: Triton and the CPU kernels), `gptserve.engine` (scheduling, the KV cache, sampling),
`gptserve.server` (the HTTP APIs) and `gptserve.training` (train.py's parts). In a checkout they
are the root's folders of the same names, mapped into this package by pyproject.toml.
The command line is `gptserve` (gptserve/cli.py).
"""

__version__ = "0.1.0"

# Installed, the parts are this folder's subfolders. In a checkout they are its siblings, which an
# editable install maps in; with the checkout only on sys.path (PYTHONPATH=., as bench/ measures an
# older revision's tree or the GPU check runs the sources) they are found there too.
import os as _os  # noqa: E402

_checkout = _os.path.dirname(_os.path.realpath(__path__[0]))  # also through a symlink to it
if not _os.path.isdir(_os.path.join(__path__[0], "model")) and _os.path.isfile(
    _os.path.join(_checkout, "model", "__init__.py")
):
    __path__.append(_checkout)
