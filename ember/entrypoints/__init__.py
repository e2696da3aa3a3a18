"""Launch lines people copy from other engines (`python -m ember.entrypoints.openai.api_server`)."""
