"""The management plane's API: the policy (`service`), the cluster's state (`plane`), the REST
types and OpenAPI document, and the composition root (`cluster`).

A regular package (not a namespace one) so import tools see it: the layering test
(tests/test_layers.py) builds its graph with grimp, which skips namespace packages.
"""
