"""The OpenAI-compatible server, its metrics and its web page."""
