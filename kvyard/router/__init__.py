"""A cache-aware router in front of several kvyard workers: itself an OpenAI-compatible endpoint.

See docs/architecture.md ("The router") for the module map.
"""
