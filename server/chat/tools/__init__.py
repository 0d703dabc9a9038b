"""Tool calling: `request` checks a chat request's `tools`, `tool_choice` and `parallel_tool_calls`;
`prompt` renders tools, earlier calls and their results into the chat's messages; `formats` says
how a model family writes calls (hermes, llama3_json); `grammar` and `bounds` give the grammar and
the bounded argument schemas calls are generated under; `parser` reads the answer back as content
and tool calls. Nothing is re-exported here: import from the modules.
"""
