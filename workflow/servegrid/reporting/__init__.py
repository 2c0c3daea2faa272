"""The run's tables → what people and other tools read: figures, the bilingual report (HTML and PDF), the
terminal summary, exports and the comparison of two runs."""
