"""Programs: the ``kvpolicy`` command line and the policy-cache HTTP server."""
