"""The engine: requests, KV ledger and scheduler (pure), sampling, the model runner and the LLM API."""
