"""The serving wing: serve.py's engine and its protocol.

engine (the continuous-batching scheduler and EngineSettings), process (the engine in a process of its own),
openai (OpenAI's request and response models, their checks and errors, the replies), metrics (Prometheus'
counters and histograms for /metrics).
"""
