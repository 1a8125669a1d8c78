"""Job kinds (summarize, extract, code-review, chat): documents into engine requests, outputs into results.

Nothing lives here yet: the job kinds arrive with the pipeline (issue 3).
"""
