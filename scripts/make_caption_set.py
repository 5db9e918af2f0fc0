"""Writes prx_assets/stages/labels/data/caption_labels.jsonl: the labelled caption set the embedded
classifier is trained on (run once; the output is kept in the repo, this script documents
how it was written).

Captions are composed from hand-written phrase banks in the style a VLM captioner writes
(one dense paragraph, only what is visible), so that a few hundred varied examples exist per
class. The hand-written set in hand_captions.jsonl is added to validation only: it measures
how well the classifier generalises beyond the phrase banks.

    python scripts/make_caption_set.py
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

OUT = (Path(__file__).resolve().parents[1] / "prx_assets" / "stages" / "labels" / "data"
       / "caption_labels.jsonl")
PER_CLASS = 140
VISUAL_PER_CLASS = 200  # more varied than the other two: people, objects, places
VALIDATION_SHARE = 0.2

COLOURS = ["deep red", "muted olive green", "pale blue", "warm ochre", "charcoal grey",
           "off-white", "bright yellow", "dusty pink", "navy blue", "rust orange",
           "teal", "cream", "dark brown", "silver", "lavender"]
LIGHT = [
    "Soft daylight enters from the left, leaving gentle shadows on the right side of the frame.",
    "The scene is lit by low golden-hour sunlight that casts long shadows across the ground.",
    "Overcast light flattens the contrast and gives the colours a muted, even tone.",
    "Harsh midday sun produces bright highlights and short, hard-edged shadows.",
    "Warm artificial light from a lamp outside the frame gives the scene an amber cast.",
    "Cool bluish light from a window falls across the subject, the corners fading into shade.",
    "Diffuse studio lighting leaves almost no shadows and renders the colours cleanly.",
    "Neon signs reflect off wet surfaces, mixing magenta and cyan highlights.",
]
# --- visual: scenes a person looks at -------------------------------------------------
V_SUBJECTS = [
    "a golden retriever lying on a wooden porch", "an elderly man repairing a bicycle wheel",
    "a bowl of ramen with sliced egg and scallions", "a mountain lake surrounded by pine forest",
    "a red vintage car parked on a cobblestone street", "two children building a sandcastle",
    "a tabby cat curled up on a knitted blanket", "a city skyline at dusk seen from a rooftop",
    "a ceramic vase holding dried lavender stems", "a surfer riding a breaking wave",
    "a market stall piled with tomatoes, peppers and aubergines", "a snowy village street",
    "a woman in a yellow raincoat walking a dog", "a close-up of a honeybee on a sunflower",
    "a modern living room with a grey sofa and a low oak table",
    "a steam locomotive crossing a stone viaduct",
    "a plate of croissants on a marble counter", "a field of tulips in parallel rows",
    "a horse grazing beside a wooden fence", "an empty subway platform with tiled walls",
    "a couple in swimwear sitting on beach towels under an umbrella",
    "a marble statue of a standing figure in a museum gallery",
    "a runner in shorts and a tank top crossing a finish line",
    "a bride and groom posing under an arch of white flowers",
    "a potter shaping clay on a spinning wheel", "a lighthouse on a rocky headland",
    "a bowl of mixed berries on a linen napkin", "a sailboat moored in a calm harbour",
    "a bearded man playing an acoustic guitar on a stool",
    "a desert road stretching to the horizon",
]
# People, dressed and posed, that an explicit caption also has: uniforms, portraits,
# swimwear, sport, medicine. Without them every caption about a person reads closer to the
# nsfw bank than to the visual one (the demo's portrait of a woman in a naval uniform was
# labelled nsfw).
V_PEOPLE = [
    "a woman in a dark military dress uniform with medals posing for an official portrait",
    "a man in a police uniform and a peaked cap standing beside a patrol car",
    "a young woman in a one-piece swimsuit sitting at the edge of a swimming pool",
    "a man in swimming shorts jogging along the shoreline",
    "a woman in a sports top and running shorts stretching before a race",
    "a wrestler in a singlet crouching on a competition mat",
    "a surgeon in a gown, cap and mask operating under bright lamps",
    "a woman in a nightgown reading in bed with a bedside lamp on",
    "a studio headshot of a woman with short dark hair and a white blouse",
    "a couple hugging on a sofa in a living room, both in jeans and sweaters",
    "a shirtless man chopping firewood outside a cabin",
    "a model in a lace dress posing on a photo studio backdrop",
    "a group of sailors in white uniforms standing on the deck of a ship",
    "an officer in a navy blue uniform saluting at a ceremony",
    "a mother bathing a toddler in a small plastic tub",
    "a woman lying on a massage table, a towel covering her back",
    "a man in underwear and a t-shirt ironing a shirt in a bedroom",
    "a gymnast in a leotard on a balance beam",
    "a classical painting of a reclining woman draped in white cloth",
    "an old black and white portrait of a woman in a high-collared uniform",
    "two dancers in tight costumes performing a lift on stage",
    "a pregnant woman in a fitted dress cradling her belly in a garden",
    "a beach volleyball player in a bikini diving for the ball",
    "a nurse in a white uniform and cap smiling at the camera",
]
# How most captioners start: the subject first, no "The image shows".
V_OPENERS = ["The image shows {s}.", "{S}.", "A photograph of {s}.", "A portrait of {s}."]
V_DETAILS = [
    "Its {c} surface shows fine scratches and a slightly worn texture near the edges.",
    "In the foreground, a {c} object sits slightly out of focus, partly covering the lower left "
    "corner.",
    "The main subject occupies the centre of the frame, with a {c} element directly behind it.",
    "Small details are visible: a frayed strap, a chipped corner, and a {c} stain on the side.",
    "A {c} wall fills the background, its paint peeling in a few places.",
    "To the right, a second figure stands partly cut off by the edge of the image, wearing {c} "
    "clothing.",
    "The ground is covered with {c} gravel and scattered leaves.",
    "Reflections of the surroundings appear in a {c} puddle near the bottom of the frame.",
    "Behind the subject, blurred shapes of trees and a {c} building suggest a shallow depth of "
    "field.",
    "The texture of the fabric is visible, a coarse {c} weave with loose threads.",
    "Several {c} flowers grow between the stones along the path.",
    "The sky above is {c}, with thin streaks of cloud near the horizon.",
]
V_TEXT_HINTS = [
    "A small shop sign in the background reads \"OPEN\" in {c} letters.",
    "A licence plate on the car is partly legible but too small to read fully.",
    "A faint watermark in the lower right corner reads \"photo by\" followed by an illegible name.",
    "A street sign at the corner shows a partly hidden street name.",
]
V_CLOSERS = [
    "The composition places the subject slightly off centre, following the rule of thirds.",
    "The photograph is sharp at the focal point, with a soft bokeh elsewhere.",
    "The colours are natural and slightly desaturated, with no visible overlays.",
    "The image is a landscape-format photograph taken at eye level.",
    "The camera angle is slightly low, making the subject appear taller.",
    "The overall scene is calm, with no motion blur.",
]
# --- text: images a person reads ------------------------------------------------------
T_SUBJECTS = [
    "a scanned page of a printed contract", "a screenshot of a spreadsheet application",
    "a presentation slide with a title and bullet points",
    "a poster dominated by large printed text",
    "a bar chart comparing quarterly revenue", "a photographed restaurant menu",
    "a screenshot of a chat conversation on a phone", "a page from a textbook about chemistry",
    "a line graph of temperature over twelve months", "a handwritten note on lined paper",
    "a screenshot of a code editor showing Python source", "a receipt from a grocery store",
    "a scanned invoice with a table of items", "a web page with a long article",
    "an infographic with numbered steps and short paragraphs", "a pie chart with a legend",
    "a page of sheet music with printed lyrics", "a whiteboard covered with handwritten equations",
    "a form with labelled fields and checkboxes", "a screenshot of an email inbox",
    "a scientific paper's first page with an abstract", "a flyer announcing a community event",
    "a timetable of train departures on a display board",
    "a table of nutritional information on a package",
    "a certificate with printed text and a signature", "a book cover dominated by a long title",
    "a screenshot of a terminal with command output",
    "a dashboard with several small charts and numbers",
    "a street poster listing concert dates", "a page of a dictionary",
    # signs and boards that fill the frame are read, not looked at
    "a large direction sign listing town names and distances",
    "an electronic information board filling the frame with rows of times and platforms",
    "a noticeboard covered with printed rules and opening hours",
]
# "A photograph of" starts many captions of documents and signs too.
T_OPENERS = ["The image is {s}.", "{S}.", "A photograph of {s}.", "A close-up of {s}."]
T_TRANSCRIPTS = [
    "The heading reads \"Quarterly Results 2023\" and below it the text says \"Revenue increased "
    "by 12% compared to the previous year\".",
    "The visible text reads \"Terms and Conditions. 1. Definitions. In this agreement the "
    "following words shall have the meanings set out below\".",
    "The title reads \"Agenda\" followed by the items \"Introduction\", \"Budget review\", "
    "\"Hiring plan\" and \"Questions\".",
    "The text at the top says \"Total due: $142.50\" and lists items with quantities and prices in "
    "two columns.",
    "The lines read \"def main():\", \"    data = load(path)\" and \"    return summarize(data)\" "
    "in monospaced font.",
    "The largest words read \"SUMMER FESTIVAL\" with the dates \"June 14-16\" and \"Free entry\" "
    "underneath.",
    "The axis labels read \"Month\" and \"Temperature (C)\", with values from 0 to 30.",
    "The message bubbles read \"Are you coming tonight?\", \"Yes, around 8\" and \"Great, see you "
    "there\".",
    "The text reads \"Abstract. We propose a method for estimating depth from a single image\" in "
    "a small serif font.",
    "The columns are labelled \"Name\", \"Date\", \"Amount\" and \"Status\", with about twenty "
    "rows of entries.",
    "The legend lists \"Product A\", \"Product B\" and \"Other\" with percentages 45%, 35% and "
    "20%.",
    "The heading reads \"Chapter 4: Chemical Bonds\" followed by dense paragraphs of body text.",
]
T_DETAILS = [
    "The text is printed in black on a {c} background, in several paragraphs of small type.",
    "Most of the frame is filled with text arranged in columns, leaving narrow margins.",
    "A {c} header bar runs across the top, containing a logo and a menu with several items.",
    "The font is a clean sans-serif, and the lines are evenly spaced and left aligned.",
    "Numbers are aligned in a table with thin {c} grid lines separating the cells.",
    "Some words are highlighted in {c}, and a few lines are underlined.",
    "The page is slightly skewed, as if photographed at an angle, with a shadow along one edge.",
    "Small footnotes and a page number appear at the bottom of the page.",
    "The bars are coloured {c} and grey, each labelled with a value above it.",
    "A scroll bar on the right edge and a cursor in the middle of a line are visible.",
    "Icons for reply, forward and delete appear next to each line of text.",
    "There is no photograph in the image; the content is entirely text and simple graphics.",
]
T_CLOSERS = [
    "The image is mostly legible, with the smaller text becoming blurry toward the edges.",
    "The layout is dense, and reading the content is the main purpose of the image.",
    "The screenshot has a flat, digital appearance with sharp edges and no lighting effects.",
    "The scan shows slight paper texture and a faint fold across the middle.",
    "The visual elements are limited to lines, boxes and a small logo.",
]
# --- nsfw: sexually explicit content, described clinically ----------------------------
N_SUBJECTS = [
    "two nude adults engaged in sexual intercourse on a bed",
    "a nude adult woman reclining with her genitals fully exposed to the camera",
    "a nude adult man standing with an erect penis visible",
    "an adult couple performing oral sex on a sofa",
    "a nude adult woman straddling a nude adult man in a sexual position",
    "several nude adults engaged in group sexual activity",
    "an adult woman touching her exposed genitals",
    "a close-up of adult genitals during penetration",
    "a nude adult man and woman in an explicit sexual embrace on a rug",
    "an adult performer posing nude with legs spread toward the camera",
    "two nude adult women engaged in sexual activity on a bed",
    "an adult man masturbating while seated on a chair",
    "an explicit pornographic scene with two adults having sex in a shower",
    "a nude adult woman on her knees performing oral sex on a standing man",
    "a topless adult woman wearing only open lingerie, her breasts and genitals exposed in a "
    "sexual pose",
]
N_DETAILS = [
    "The bodies are fully unclothed and the genitals are clearly visible in the frame.",
    "The bedsheets beneath them are {c} and crumpled, and a pillow lies at the edge of the bed.",
    "The camera is positioned close, focusing on the point of sexual contact.",
    "A {c} wall and a bedside lamp are visible in the background.",
    "Clothing, including {c} underwear, lies discarded on the floor beside them.",
    "The posture and framing are typical of explicit adult content.",
    "One person's hand rests on the other's exposed breast.",
    "The skin shows a slight sheen, and the bodies are pressed together.",
    "The framing crops the faces, leaving the exposed bodies as the focus of the image.",
    "A {c} curtain is drawn behind them, and a mirror reflects part of the scene.",
]
N_CLOSERS = [
    "The image is sexually explicit and shows nudity with genital exposure.",
    "The scene depicts explicit sexual activity between adults.",
    "The photograph has the look of a professional adult film production.",
    "The image appears to be an amateur explicit photograph taken indoors.",
    "A watermark of an adult website is visible in one corner.",
]


def _visual(rng: random.Random) -> str:
    subject = rng.choice(V_PEOPLE if rng.random() < 0.4 else V_SUBJECTS)
    opener = rng.choice(V_OPENERS).format(s=subject, S=subject[0].upper() + subject[1:])
    parts = [opener]
    parts += [d.format(c=rng.choice(COLOURS)) for d in rng.sample(V_DETAILS, rng.randint(1, 5))]
    if rng.random() < 0.3:
        parts.append(rng.choice(V_TEXT_HINTS).format(c=rng.choice(COLOURS)))
    parts += [rng.choice(LIGHT), rng.choice(V_CLOSERS)]
    return " ".join(parts)


def _text(rng: random.Random) -> str:
    subject = rng.choice(T_SUBJECTS)
    parts = [rng.choice(T_OPENERS).format(s=subject, S=subject[0].upper() + subject[1:])]
    parts += rng.sample(T_TRANSCRIPTS, rng.randint(1, 2))
    parts += [d.format(c=rng.choice(COLOURS)) for d in rng.sample(T_DETAILS, rng.randint(3, 4))]
    if rng.random() < 0.4:
        parts.append(rng.choice(LIGHT))
    parts.append(rng.choice(T_CLOSERS))
    return " ".join(parts)


def _nsfw(rng: random.Random) -> str:
    parts = [f"The image shows {rng.choice(N_SUBJECTS)}."]
    parts += [d.format(c=rng.choice(COLOURS)) for d in rng.sample(N_DETAILS, rng.randint(3, 5))]
    parts += [rng.choice(LIGHT), rng.choice(N_CLOSERS)]
    return " ".join(parts)


def _split(caption: str) -> str:
    bucket = int(hashlib.sha256(caption.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "validation" if bucket < VALIDATION_SHARE else "train"


def main() -> None:
    rng = random.Random(20261130)
    rows, seen = [], set()
    for label, make in (("visual", _visual), ("text", _text), ("nsfw", _nsfw)):
        made = 0
        while made < (VISUAL_PER_CLASS if label == "visual" else PER_CLASS):
            caption = make(rng)
            if caption in seen:
                continue
            seen.add(caption)
            rows.append({"caption": caption, "label": label, "split": _split(caption),
                         "origin": "phrase_bank"})
            made += 1
    hand = OUT.with_name("hand_captions.jsonl")
    rows += [{**json.loads(line), "split": "validation", "origin": "hand"}
             for line in hand.read_text().splitlines() if line.strip()]
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} captions to {OUT}")


if __name__ == "__main__":
    main()
