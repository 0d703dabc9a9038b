"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/ps`,
`/api/show`, `/api/version`) over the served model and its LoRA adapters: a request becomes the
chat, completion or embeddings request the server already checks and runs (`request`), its answer
Ollama's NDJSON lines or one object (`api`), and errors on /api/ leave as `{"error": "..."}`
(`errors`)."""
