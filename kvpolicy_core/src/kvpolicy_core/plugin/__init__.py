"""Plugin host: hook specifications, entry-point discovery, the registry of parts and methods, the
built-in parts, and the base configs a method's config derives from."""
