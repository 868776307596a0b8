"""The engines that run a prepared model on ORT under the budget.

The streaming engine (one ORT session, captured, with the page-ins in its graph) and the
segment runner (one ORT session per segment) offer one surface; ``switch.Engines`` holds
the one in force and the fallback between them. OrtValues over the package's memory, a
split session's IOBinding and the graph-capture decision live here too.
"""
