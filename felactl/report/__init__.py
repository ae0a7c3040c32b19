"""Seeing a run: ``felactl report RUN`` draws what the run recorded as PNG figures and one
self-contained HTML page (the figures inside it, no server, no network), for a finished, a running
or a lost run alike.

:mod:`~felactl.report.series` reads the run into the series drawn (pure);
:mod:`~felactl.report.figures` draws them with matplotlib; :mod:`~felactl.report.page` writes
the figures and the page, each whole or not at all (:func:`~felactl.report.page.write_report`).
"""
