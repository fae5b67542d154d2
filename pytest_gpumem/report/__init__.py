"""What a person or a CI step reads of a run: the terminal table (terminal), Markdown (markdown), the JSON
document (json) and the explanation page (html, with its jinja2 template in templates/ and its CSS and
script in static/). The files the end of a run writes are chosen from the table in `writers`."""
