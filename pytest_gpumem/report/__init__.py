"""Pure functions from results to what people read: the terminal table, Markdown and JSON."""
