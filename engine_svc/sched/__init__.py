"""The scheduler side: requests, the KV block manager and the token-budget scheduler.

No torch and nothing of the model side: this part only decides which tokens of which
requests are computed in a step, and which KV blocks they use.
"""
