"""The serving wing: serve.py's engine and its protocol.

engine (the continuous-batching scheduler), process (the engine in a process of its own), openai (OpenAI's
request and response models, their checks and errors, and the metrics).
"""
