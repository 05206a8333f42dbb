"""The serving wing: the server's engine and its protocol (serve.py keeps the routes).

engine.py (the continuous-batching scheduler and EngineSettings), process.py (the engine in a process of its
own), openai.py (OpenAI's request and response models, their checks and errors, the replies), metrics.py
(Prometheus' counters and histograms for /metrics).
"""
