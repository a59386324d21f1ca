"""The plugin contract: hook specifications, the plugin manager, the client context,
options, key helpers, authoring checks and the registries plugins fill."""
