"""What a person sees first in Dagster: each source's funnel on its last asset (a table and
a picture), numbers in words, and the checks that warned as a tag on the run (the Runs page
shows tags; a green run with warnings says so)."""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from prx_assets.stages.report.charts import (
    bar_chart_markdown,
    human_bytes,
    human_duration,
    percent,
    png_markdown,
    tier_shape_markdown,
)
from prx_assets.stages.report.contact_sheet import contact_sheet_png, reject_samples
from prx_assets.stages.report.cost import cost_markdown, cost_per_1000
from prx_assets.stages.report.funnel import Funnel
from prx_assets.storage.refs import TableRef

WARNINGS_TAG = "prx/check_warnings"
# Dagster keeps tag values short; the names beyond this are counted, not listed.
TAG_CHARS = 200


def funnel_metadata(funnel: Funnel) -> dict:
    """`funnel` (a table: stage, images, share of raw) and `funnel_chart` (bars in a
    Markdown table the UI draws on the asset page), the share kept in words, and
    `opt_in_lists` (the opt-in lists' sizes, outside the funnel) when there are any."""
    rows = funnel.rows()
    shares = [count / funnel.raw if funnel.raw else 0.0 for _, count in rows]
    table = dg.MetadataValue.table(
        [dg.TableRecord({"stage": name, "images": count, "share_of_raw": percent(share)})
         for (name, count), share in zip(rows, shares, strict=True)],
        schema=dg.TableSchema(columns=[dg.TableColumn("stage", "string"),
                                       dg.TableColumn("images", "int"),
                                       dg.TableColumn("share_of_raw", "string")]))
    # Counts only beside the bars (the table gives the shares): a row fits the page.
    chart = bar_chart_markdown([name for name, _ in rows], [count for _, count in rows],
                               f"{funnel.source}: where the images go")
    # Short: the UI cuts a value at its column's edge rather than wrap it.
    lists = ", ".join(f"{reason} {n:,}" for reason, n in sorted(funnel.opt_in.items()))
    opt_in = {"opt_in_lists": dg.MetadataValue.text(f"{lists} (skipped only when named)")} \
        if funnel.opt_in else {}
    return {"funnel": table,
            "funnel_chart": dg.MetadataValue.md(chart),
            "streamed_share_of_raw": dg.MetadataValue.text(
                percent(funnel.streamed / funnel.raw if funnel.raw else 0)), **opt_in}


def bands_chart(counts: dict[str, int], title: str, order: list[str] | None = None
                ) -> dg.MetadataValue:
    """A histogram of labelled bands (megapixels, aspect ratios): bars in a Markdown table
    the UI draws on the asset page."""
    labels = order or sorted(counts)
    labels = [label for label in labels if label in counts]
    return dg.MetadataValue.md(bar_chart_markdown(labels, [counts[label] for label in labels],
                                                  title))


def tier_shape_matrix(counts: dict[tuple[int, str], int]) -> dg.MetadataValue:
    return dg.MetadataValue.md(tier_shape_markdown(counts))


def size_in_words(n_bytes: int) -> dg.MetadataValue:
    return dg.MetadataValue.text(human_bytes(n_bytes))


def duration_metadata(name: str, seconds: float) -> dict:
    """A duration as a number (for plots across runs) and beside it in words:
    {"stage_seconds": 75.0, "stage_seconds_in_words": "1 min 15 s"}."""
    return {name: round(seconds, 2),
            f"{name}_in_words": dg.MetadataValue.text(human_duration(seconds))}


def cost_metadata(seconds: float, rows: int, gpus: float, gpu_hour_usd: float,
                  cpu_hour_usd: float) -> dict:
    """`cost_per_1000_images` (a line of Markdown) and its dollars as a number; nothing
    when the run processed no rows."""
    cost = cost_per_1000(seconds, rows, gpus, gpu_hour_usd, cpu_hour_usd)
    if cost is None:
        return {}
    return {"cost_per_1000_images": dg.MetadataValue.md(cost_markdown(cost)),
            "cost_per_1000_images_usd": round(cost.usd, 4)}


def reject_sheet_metadata(bucketed: TableRef, raw: TableRef, counts: Mapping[str, int]) -> dict:
    """`rejects_contact_sheet`: thumbnails of the first rejected images per reason that
    decode, as a PNG in Markdown; nothing when there are none."""
    png = contact_sheet_png(reject_samples(bucketed, raw), counts)
    if png is None:
        return {}
    return {"rejects_contact_sheet": dg.MetadataValue.md(
        png_markdown(png, "rejected images per reason"))}


# ------------------------------------------------------------------ warnings on the run

def check_warnings(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """`asset:check` of every check evaluation of the run that did not pass, in order."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
    found = []
    for record in records:
        event = record.event_log_entry.dagster_event
        evaluation = event.asset_check_evaluation_data if event else None
        if evaluation is not None and not evaluation.passed:
            name = f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"
            if name not in found:
                found.append(name)
    return found


def warnings_tags(names: list[str]) -> dict[str, str]:
    """The run's tag: "none", or "2: labels:label_shares, skip_lists:skipped_share"."""
    if not names:
        return {WARNINGS_TAG: "none"}
    listed = f"{len(names)}: {', '.join(names)}"
    if len(listed) > TAG_CHARS:
        listed = listed[:TAG_CHARS - 1] + "…"
    return {WARNINGS_TAG: listed}


def tag_run_with_warnings(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    """Adds the warnings tag to a finished run; returns it."""
    tags = warnings_tags(check_warnings(instance, run_id))
    instance.add_run_tags(run_id, tags)
    return tags


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, name="check_warnings_tag",
                      monitor_all_code_locations=False,
                      default_status=dg.DefaultSensorStatus.RUNNING,
                      description="Tags each successful run with the checks that warned "
                                  f"({WARNINGS_TAG}), so the Runs page shows them.")
def check_warnings_tag(context: dg.RunStatusSensorContext) -> None:
    tags = tag_run_with_warnings(context.instance, context.dagster_run.run_id)
    context.log.info(f"run {context.dagster_run.run_id[:8]}: {tags[WARNINGS_TAG]}")


def report_defs() -> dg.Definitions:
    return dg.Definitions(sensors=[check_warnings_tag])
