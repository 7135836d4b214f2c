"""The plugin host: the hooks (pluggy), discovery of the plugins, and the registry they fill."""
