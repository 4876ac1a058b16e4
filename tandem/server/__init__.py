"""The OpenAI-compatible HTTP server: routes, auth, fan-out, response shapes, Prometheus metrics."""
