"""The REST API (FastAPI): one router module per resource, errors mapped at the edge."""
