"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a Responses request becomes
the chat request the server already checks and runs (`request`), its answer becomes a response
object or the typed event stream (`api`), and stored responses continue by
`previous_response_id` (`store`)."""
