"""Chat: a chat request's messages made into one prompt, with its tools. `templates` holds the chat
formats (a checkpoint's Jinja template, rendered as transformers renders it, or the plain
"Role: content" template and its `chat_template.txt`) and their one error, `ChatTemplateError`;
the `tools` subpackage holds tool calling, from the request's `tools` to the calls read back out of
the answer. Nothing is re-exported here: import from the modules.
"""
