"""HTTP only: the OpenAI-compatible app, its CLI (`python -m server`) and the Ray deployment.

Everything between a request and its tokens is in `engine/`; the network is in `model/`.
"""
