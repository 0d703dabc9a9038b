"""OpenAI's files and fine-tuning jobs on the serving box (--enable-fine-tuning; docs/API.md).

- `store`: records (files, jobs) kept as JSON under --state-dir, reloaded at start;
- `files_api`: /v1/files (upload checked with training.chat_data.check_chat_file);
- `recipe`: a job's hyperparameters and the `gptserve train` command line it runs;
- `runner`: one training subprocess (nice 10, bounded threads) and its metrics.jsonl;
- `manager`: the queue, one job at a time, the results loaded into the LoRA slots;
- `jobs_api`: /v1/fine_tuning/jobs;
- `schemas`: the bodies as /openapi.json describes them (the job request validated).

Every record has an `owner` (the API key's tenant, server.tenancy; None on an open server): a
key sees only its own, and another key's id is a 404 like an unknown one.
"""
