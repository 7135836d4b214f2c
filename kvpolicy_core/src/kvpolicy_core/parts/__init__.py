"""Policy parts shipped with kvpolicy-core: shared by every method that needs them."""
