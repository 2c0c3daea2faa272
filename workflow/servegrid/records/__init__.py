"""What one request is and how a cell keeps its requests: the request record, its per-request formulas, the cell file.

The bottom of the package with ``stats/`` and ``engines/``: the client fills records, the measured phase counts
them, the analysis reads them, and none of these import each other to do so.
"""
