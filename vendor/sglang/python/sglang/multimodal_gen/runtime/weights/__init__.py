"""Weight source contracts shared by runtime loaders."""
