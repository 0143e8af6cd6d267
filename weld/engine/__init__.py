"""The engine: scheduling (pure Python), the model runner (device), and the public LLM API."""
