"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat
path: a Messages request becomes the chat request the server already checks and runs
(`request`), its answer becomes a message object or Anthropic's named event stream (`api`), and
errors on these paths leave in Anthropic's shape (`errors`)."""
