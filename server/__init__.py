"""HTTP only: the OpenAI-compatible app, its CLI (`gptserve serve`) and the Ray deployment.

Everything between a request and its tokens is in `engine/`; the network is in `model/`.
"""
