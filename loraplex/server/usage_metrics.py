"""Prometheus view of usage accounting (``usage_recorder.UsageRecorder.stats``), read at scrape
time: ``loraplex_usage_records_dropped_total`` (rows the database refused, dropped after being
logged), ``loraplex_usage_requests_dropped_total`` (requests not counted because the in-memory
bound was reached during an outage), ``loraplex_usage_failed_flushes_total`` and
``loraplex_usage_pending_rows``, ``loraplex_usage_spooled_batches`` (batches on disk waiting for
the database) and ``loraplex_usage_spool_files_set_aside_total`` (spool files that could not be
read, renamed ``*.bad``). Any of the two dropped counters or the set-aside one above zero means
usage is missing from the billing table."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class UsageCollector:
    """Collector of one recorder's counters; register it on the server's CollectorRegistry."""

    def __init__(self, recorder):
        self.recorder = recorder

    def describe(self):
        return []

    def collect(self):
        stats = self.recorder.stats()
        for name, doc, key in (
            ("loraplex_usage_records_dropped", "Usage rows (tenant, adapter, hour) the database refused; "
             "logged with their counts, then dropped.", "dropped_records"),
            ("loraplex_usage_requests_dropped", "Requests left out of usage accounting: the rows waiting "
             "to be written were at their limit.", "dropped_requests"),
            ("loraplex_usage_failed_flushes", "Usage flushes that failed and are retried.", "failed_flushes"),
            ("loraplex_usage_spool_files_set_aside", "Usage spool files that could not be read, renamed "
             "*.bad for a person to look at; their usage is not counted.", "spool_files_set_aside"),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], stats[key])
            yield counter
        for name, doc, key in (
            ("loraplex_usage_pending_rows", "Usage rows summed in memory, not yet written.", "pending_rows"),
            ("loraplex_usage_spooled_batches", "Usage batches spooled to disk, waiting to be written.",
             "spooled_batches"),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], stats[key])
            yield gauge
