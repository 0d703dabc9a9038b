"""Everything between a request and its tokens.

One step reads top to bottom, in `engine.py`: `scheduler.py` decides which sequences run and how
many new tokens each gets (a `StepPlan`, `step_plan.py`), `runner.py` runs the model's one forward
over the paged KV cache (its pools and attention `kernels.paged_kv`; which block holds what
`block_manager.py`, the scheduler's, with its allocator in `block_pool.py` and prompt reuse in
`prefix_index.py`), and the engine samples (`sampler.py`, with `grammar.py` masks and `verify.py`
for speculative guesses from `proposers.py`) and turns the tokens into events on each
`Sequence`. `async_engine.py` drives it from a thread for the server;
`loader.py` builds a servable model from a checkpoint; `limits.py` admits a request (every limit
in one call, `RequestLimits.admit`, made once by the server or by `Engine.add_request`; a refusal
is one `RequestError` from `errors.py`); `gptserve generate` generates offline.
"""

from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.sampler import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestError", "SamplingParams"]
