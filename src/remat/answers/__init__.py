"""Answers: what a user reads. Does it fit and how (`fit`), strategies measured side by side
(`bench`), tables, JSON and plots (`report`), one HTML page (`html`) and the command line (`cli`).
Imports every stage below it."""
