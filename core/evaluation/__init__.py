"""The evaluation wing: a trained model judged, on a whole split, on HellaSwag, or on its answers.

perplexity.py (loss, perplexity, bits per byte), hellaswag.py (4 endings ranked by loss), answers.py (a chat
model's exact answers, a checked task's exact match and pass@k).
"""
