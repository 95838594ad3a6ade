"""A small plain-English corpus shipped with kvplugin.

It is only used to train the byte-level BPE tokenizer of the tiny test model
(:mod:`kvplugin.tools.models.tiny`), so that the model can be built offline. The text
was written for this project; it has no meaning beyond giving the tokenizer a
realistic mix of common English words, punctuation, digits and line breaks.

Do not edit it casually: the tokenizer (and therefore every token id the tiny
model sees) depends on it byte for byte. Bump ``tinymodel.MODEL_VERSION`` when
you do.
"""

from __future__ import annotations

CORPUS = """\
The town sits where two rivers meet, and most mornings a thin mist lies on the
water until the sun climbs over the eastern hills. The bakery opens at six. By
seven the street smells of bread, coffee and wet stone, and the first buses
carry people to the station, the hospital and the school on the hill.

Nobody remembers exactly when the old bridge was built. Some say it was three
hundred years ago, others say it is much older and was only repaired after the
great flood. What everyone agrees on is that the bridge has five arches, that
the middle one is the widest, and that boats with tall masts must wait for low
water before they can pass beneath it.

On market days the square fills with stalls. There are apples and pears from
the valley farms, cheese wrapped in cloth, honey in small glass jars, baskets,
knives, old books and new shoes. Children run between the tables while their
parents count coins and argue about the price of potatoes. At noon the church
bell rings twelve times, and for a moment almost everyone stops to listen.

A garden needs patience more than anything else. You prepare the soil in the
autumn, turning it over and mixing in leaves and compost. In the spring you
plant the seeds in straight rows, water them in the evening, and then you wait.
Some seeds come up after four days, some after two weeks, and a few never come
up at all. The beans climb their poles, the lettuce grows quickly and the
tomatoes ripen slowly at the end of the summer.

To make a simple soup, cut two onions, three carrots and a few potatoes into
small pieces. Warm a spoon of oil in a large pot, add the onions and cook them
gently until they are soft. Add the other vegetables, cover them with water or
stock, and let everything simmer for twenty minutes. Season with salt and
pepper. A little fresh parsley at the end makes it taste like the garden.

The library is the quietest building in town. Its reading room has tall
windows, long wooden tables and green lamps that were installed in 1921. The
librarian knows where every book is kept, even the ones that were placed on the
wrong shelf years ago. Students come in the afternoon to study, and older
readers come in the morning to read the newspapers and talk about the weather.

Weather is the favourite subject of conversation. When the wind turns to the
west, people say rain is coming, and they are usually right. In January the
rivers sometimes freeze at the edges, and in July the stones of the square are
too hot to touch. Spring is short and autumn is long. The best month, most
people say, is September, when the air is clear and the evenings are still
warm.

A computer program is a list of instructions. Each instruction is simple: add
two numbers, compare two values, copy a block of memory, jump to another place
in the list. The power of a program comes from doing millions of these small
steps every second without getting tired or bored. A good program is easy to
read, does one thing well, and fails loudly when something is wrong instead of
quietly producing the wrong answer.

Memory is a limited resource. When a program keeps too much data, the machine
slows down, and when it keeps too little, the program must compute the same
results again and again. A cache is a small store of recent results that are
likely to be needed soon. The hard questions are always the same: what should
be kept, for how long, and what should be thrown away first when the cache is
full?

The sea is forty miles to the south. On a clear day you can see it from the top
of the hill, a thin silver line between the fields and the sky. Fishing boats
leave the harbour before dawn and return in the afternoon, followed by a cloud
of gulls. The fish market closes early, so if you want fresh fish for dinner
you have to be there before two o'clock.

Letters used to arrive twice a day. The postman walked the same route for
thirty-one years, and he knew every dog, every gate and every broken step on
his way. When he retired, the whole street gave him a party with cake, music
and a card signed by one hundred and twelve people. He said it was the first
letter he had ever received that was addressed to him.

Learning to play an instrument takes years. At first your fingers do not go
where you want them to, and every song sounds slow and careful. Then one day
you notice that you are no longer thinking about your hands at all, only about
the music. Teachers say that practice should be short and regular: twenty
minutes every day is better than three hours once a week.

Questions and answers:
What is the capital of the valley? The old town by the two rivers.
How many arches does the bridge have? Five.
When does the bakery open? At six in the morning.
Which month is the best? Most people say September.
What does a cache keep? Recent results that will be needed again.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 31 42 64 100 128 256 512 1000 1024
2048 4096 8192. Dates: 1 May 1921, 12 June 2024, 3 March 1999.
Punctuation: commas, full stops. Questions? Exclamations! "Quotes", 'single
quotes', (brackets), [square brackets], {braces}; colons: and semi-colons;
hyphens - dashes -- slashes / and back\\slashes, 50% discount, $5, #1, @home,
a + b = c, x * y, 3 < 4 > 2, and_underscores_too.

The evening train leaves at eight. From the window you can see the lights of
the farms come on one by one, and then the dark shapes of the forest, and then
nothing but your own face reflected in the glass. Most passengers sleep, read
or look at their phones. The conductor walks slowly along the carriages,
checking tickets and wishing everyone a good night.
"""
