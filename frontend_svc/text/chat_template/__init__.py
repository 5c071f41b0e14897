"""Chat templates, the model's own code, rendered within a budget.

sandbox.py   the jinja2 environment (transformers' options) with size bounds
worker.py    the render process: one template, one conversation at a time, its own bounds
process.py   one render process seen from the frontend: a frame out, a frame back, by a deadline
renderer.py  the server's renders: a few render processes, killed and replaced past the budget
probe.py     the conversations every template is tried on at start, and what refuses it
"""
